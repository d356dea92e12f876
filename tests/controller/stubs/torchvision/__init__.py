"""Test-only stand-in for torchvision (see tests/controller/conftest.py): SGLang 0.5.23's cache
controller imports its multimodal processors at module level, which import torchvision; PyPI's
torchvision wheels do not load beside the CPU torch 2.13.0. Nothing here is called by the
controller's storage threads. ``__version__`` 0.0.0 makes transformers treat it as too old to use."""

from torchvision._names import InterpolationMode, __getattr__  # noqa: F401

__version__ = "0.0.0"
