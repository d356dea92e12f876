"""Names-only stand-in for torchvision (:func:`flatcake.replay.sglang_cpu.ensure_importable`):
SGLang 0.5.23's cache controller and host-pool package import its multimodal processors at module
level, which import torchvision; PyPI's torchvision wheels do not load beside the CPU torch 2.13.0.
Nothing here is called by the controller's storage threads or by the storage backends.
``__version__`` 0.0.0 makes transformers treat it as too old to use."""

from torchvision._names import InterpolationMode, __getattr__  # noqa: F401

__version__ = "0.0.0"
