"""The models the course carries from notebook to notebook, named once here.

Trained on the CPU:
- the course MLP: DEPTH x (Linear(WIDTH, WIDTH) + ReLU), WIDTH 1024 and DEPTH 6, so
  Ψ = 6 x (1024² + 1024) = 6,297,600. Every notebook that trains a stage on an MLP trains this
  one (01, 03-08), so its 25.2 MB of fp32 weights, its 4 MiB Linear (one stage-3 unit) and its
  bytes per step come back from one notebook to the next. On a GPU the notebooks say which
  width to use instead; the depth stays.
- the course GPT: `TinyGPT(**GPT)`, where a lesson needs attention, norms or a tied weight
  (05's units, 08's recompute and precision, 09's FSDP2).

Projected at scale (no notebook trains these; the calculators and `predict` price them):
- Llama 3.1 8B and Llama 3 70B, the published shapes (Meta's config.json for each), the
  models torchtitan's and most papers' published runs train. `llama_params` counts their Ψ.

tests/test_carried_models.py holds every notebook to these: its parameters cell sets the MLP's
width and depth, and its projections name no other model size.
"""

from __future__ import annotations

WIDTH = 1024  # the course MLP: DEPTH x (Linear(WIDTH, WIDTH) + ReLU)
DEPTH = 6
GPU_WIDTH = 4096  # what the notebooks' "GPU:" comments use: 100.7M parameters

# The course GPT: TinyGPT's keywords (zero_lab/course/workloads.py). bias=False: the key
# projection's bias learns from rounding noise alone (TinyGPT's docstring says why).
GPT = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 2,
       "bias": False}

# Published shapes (Hugging Face meta-llama/Llama-3.1-8B and Meta-Llama-3-70B config.json):
# untied input embedding and output head, grouped-query attention with 8 key/value heads,
# a SwiGLU feed-forward of ffn_hidden.
LLAMA3_8B = {"n_layers": 32, "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "kv_heads": 8,
             "vocab": 128256}
LLAMA3_70B = {"n_layers": 80, "hidden": 8192, "ffn_hidden": 28672, "heads": 64, "kv_heads": 8,
              "vocab": 128256}
AT_SCALE = {"Llama 3.1 8B": LLAMA3_8B, "Llama 3 70B": LLAMA3_70B}


def mlp_params(width: int = WIDTH, depth: int = DEPTH) -> int:
    """Ψ of DEPTH x Linear(width, width) with biases: 6,297,600 for the course MLP."""
    return depth * (width * width + width)


def llama_params(n_layers: int, hidden: int, ffn_hidden: int, heads: int, kv_heads: int,
                 vocab: int) -> int:
    """Ψ of a Llama-shaped model: embedding and head untied (2·V·h), per layer q and o
    (h² each), k and v (h·kv each, kv = h/heads·kv_heads), three SwiGLU matrices (3·h·f) and
    two RMSNorm weights (2h), and the final norm (h). Llama 3.1 8B: 8,030,261,248;
    Llama 3 70B: 70,553,706,496 (the counts their model cards round to 8B and 70B)."""
    kv = hidden // heads * kv_heads
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn_hidden + 2 * hidden
    return 2 * vocab * hidden + n_layers * layer + hidden


PSI_MLP = mlp_params()
PSI_8B = llama_params(**LLAMA3_8B)
PSI_70B = llama_params(**LLAMA3_70B)
