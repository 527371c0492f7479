"""Stand-in for MiniMax M3's MSA kernel warm-up, whose module imports NVIDIA's CuTe DSL
(nvidia-cutlass-dsl, a 92 MB wheel the GPU bundle cannot carry). vLLM 0.34.0's
kernel_warmup imports it for every model on CUDA; it warms only MiniMax M3 layers,
which the GPU tier never serves, so here it warms nothing. A pip install of the fork
brings the real module and the DSL. Copied by `python3 -m kiln gpu-bundle`.
"""


def minimax_m3_msa_warmup(worker) -> None:
    return None
