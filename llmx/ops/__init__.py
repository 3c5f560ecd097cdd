"""The only compute API model files see: linear, embedding, norms, RoPE, attention, activations.

Each op runs on the device of its inputs; `linear` and `embedding` hand quantized weights to the one
kernel dispatcher in `llmx.quant.weight`, so models never branch on a quant type or a device.
Shapes: T = tokens in this step, H = query heads, Hk = KV heads, D = head dim, E = embedding width.

One concern a module:
- `split`: weights spread over GPUs (`-sm row`: RowSplit, PartialSum) and `current_device`;
- `matmul`: matrix products where the weight lives (`linear`, `linear_many`, `embedding`);
- `norms`: RMSNorm and residual add + RMSNorm (fused kernels for small steps);
- `ffn`: the gated FFNs (`swiglu`, `geglu`) and a MoE layer's gated shared expert (`shared_expert`);
- `moe`: mixture-of-experts routing (`route`, `router`) and the routed experts' FFN (`moe_ffn`);
- `rope`: rotary position embedding (`Rope`);
- `masks`: which cached keys a query sees;
- `cached_attention`: attention over a layer's KV cache (`rope_attention`) and its kernels.
"""

from llmx.ops.cached_attention import LayerKV, attention, causal_prompt_attention, rope_attention
from llmx.ops.ffn import geglu, shared_expert, swiglu
from llmx.ops.masks import causal_mask, ring_mask
from llmx.ops.matmul import embedding, linear, linear_many
from llmx.ops.moe import moe_ffn, route, router
from llmx.ops.norms import HeadNorms, add_rms_norm, rms_norm
from llmx.ops.rope import Rope, Yarn
from llmx.ops.split import PartialSum, RowSplit, current_device

__all__ = [
    "HeadNorms",
    "LayerKV",
    "PartialSum",
    "Rope",
    "RowSplit",
    "Yarn",
    "add_rms_norm",
    "attention",
    "causal_mask",
    "causal_prompt_attention",
    "current_device",
    "embedding",
    "geglu",
    "linear",
    "linear_many",
    "moe_ffn",
    "ring_mask",
    "rms_norm",
    "rope_attention",
    "route",
    "router",
    "shared_expert",
    "swiglu",
]
