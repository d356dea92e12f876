from torchvision._names import InterpolationMode, __getattr__  # noqa: F401
