#!/usr/bin/env bash
# On a CUDA machine: run the equivalence/distribution tests on cuda, then a short bf16 speed-up run.
# Works with the machine's own python3 (torch + transformers preinstalled); no network needed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not found"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
status=0
echo "== equivalence, verification and distribution tests on cuda =="
AGENTSPEC_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/unit/test_verify.py tests/unit/test_equivalence.py tests/unit/test_sampling_distribution.py || status=1
echo "== short bf16 speed-up run on cuda =="
$PY benchmarks/gpu_check.py --device cuda --dtype bfloat16 || status=1
echo "== same in fp32 =="
$PY benchmarks/gpu_check.py --device cuda --dtype float32 --prompts 2 || status=1
echo "gpu_check: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status
