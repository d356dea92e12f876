"""The direct linker's tests run SGLang 0.5.23's real linker classes on CPU tensors standing for
the device pools; SGLang's import chain needs FlatCake's CPU stand-ins first
(:mod:`flatcake.testing.cpu_shims`: ``torchvision``, ``sgl_kernel``)."""

from flatcake.testing import cpu_shims

cpu_shims.install()
