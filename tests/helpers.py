"""Test helpers: tiny models built from configs with fixed seeds (never downloaded).

``AGENTSPEC_TEST_DEVICE`` (default ``cpu``) runs the model tests on another device, e.g. ``cuda`` in
``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import os

import torch

from agentspec.models import LoadedModel
from agentspec.models.attention import use_agentspec_attention

VOCAB = 97  # the char tokenizer's size: <s>, </s>, printable ASCII
EOS = 1


def device_under_test() -> torch.device:
    return torch.device(os.environ.get("AGENTSPEC_TEST_DEVICE", "cpu"))


def char_tokenizer():
    """A real transformers tokenizer, one token per printable ASCII character (id 1 is </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": EOS, **{chr(c): i + 2 for i, c in enumerate(range(32, 127))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    out.chat_template = CHAT_TEMPLATE
    return out


# A minimal chat template for the char tokenizer (every character it emits is in the vocabulary).
CHAT_TEMPLATE = (
    "{% if tools %}[tools]{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] if m['content'] is string else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_model(seed: int, layers: int = 2, dtype: torch.dtype = torch.float32, vocab: int = VOCAB,
               hidden: int = 64) -> LoadedModel:
    """A random-weight Llama-shaped model; same seed, same weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=EOS, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # sharpen the random model's preferences so greedy outputs are varied rather than constant
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    device = device_under_test()
    model.to(device).eval()
    if device.type == "cpu":  # as models.load_model runs CPU inference models
        use_agentspec_attention(model)
    return LoadedModel(model, char_tokenizer(), f"tiny-{seed}", device, dtype)


def plain_greedy(target: LoadedModel, prompt: list[int], max_new_tokens: int, eos: int | None = EOS) -> list[int]:
    """Reference output: transformers' own greedy generate."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0
    )
    ids = torch.tensor([prompt], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def make_prompt(seed: int, length: int = 40) -> list[int]:
    """Random printable tokens with some repetition, so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, VOCAB, (length // 2,), generator=g).tolist()
    return base + base[: length - len(base)]


def masked_plain_greedy(target: LoadedModel, prompt: list[int], max_new_tokens: int, tools=None, tool_choice=None,
                        response_format=None, stop_token_ids=(EOS,), parallel=True) -> list[int]:
    """Reference output of constrained decoding: one full forward per token (no cache, no drafts, no
    jump-forward), the argmax among the tokens the grammar allows (stop tokens where it accepts), llguidance
    driven directly."""
    import llguidance
    import llguidance.torch as lt

    from agentspec.drafters.grammar import ToolCallGrammar
    from agentspec.toolcalls import normalise_tools

    g = ToolCallGrammar(target.tokenizer, normalise_tools(tools), tool_choice, response_format)
    grammar, error = g.compile(g.enforced(tool_choice, parallel))
    assert error is None, error
    m = llguidance.LLMatcher(g._ll, grammar, log_level=0)
    bitmask = lt.allocate_token_bitmask(1, g.vocab_size)
    tokens, out = list(prompt), []
    while len(out) < max_new_tokens:
        with torch.no_grad():
            logits = target.model(torch.tensor([tokens], device=target.device)).logits[0, -1].float().cpu()
        lt.fill_next_token_bitmask(m, bitmask)
        allowed = torch.tensor([bool((int(bitmask[0, t // 32]) >> (t % 32)) & 1) for t in range(g.vocab_size)])
        allowed[list(stop_token_ids)] = bool(m.is_accepting())
        if not allowed.any():
            allowed[list(stop_token_ids)] = True
        masked = torch.full_like(logits, float("-inf"))
        masked[: g.vocab_size][allowed] = logits[: g.vocab_size][allowed]
        tok = int(masked.argmax())
        out.append(tok)
        tokens.append(tok)
        if tok in stop_token_ids:
            break
        assert m.consume_token(tok), m.get_error()
    return out
