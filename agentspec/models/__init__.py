"""Models for speculation: loading them (:mod:`.loading`), packed CPU linears (:mod:`.cpu_kernels`), a
drafter's quantised linears (:mod:`.quant`) and reduced vocabulary (:mod:`.vocab`), KV caches and forward
passes (:mod:`.kv`). Re-exports each submodule's ``__all__`` (PEP 8's one use of ``*``)."""

from agentspec.models.cpu_kernels import *  # noqa: F403
from agentspec.models.kv import *  # noqa: F403
from agentspec.models.loading import *  # noqa: F403
from agentspec.models.quant import *  # noqa: F403
from agentspec.models.vocab import *  # noqa: F403
