"""Stand-in for FlashInfer (flashinfer-python: a 101 MB wheel, with the 92 MB CuTe DSL it
needs), which the GPU bundle cannot carry. It holds only ``flashinfer.norm``, the Gemma
RMSNorm that vLLM 0.34.0's Qwen3.5 on NVIDIA (vllm/models/qwen3_5/nvidia) calls in every
layer. The bundle's run script keeps vLLM's ``has_flashinfer()`` False (a CUDA_HOME
without nvcc), so nothing else selects FlashInfer. A pip install of the fork brings the real package.
Copied by `python3 -m kiln gpu-bundle`.
"""
