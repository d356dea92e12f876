"""FlatCake kernels (installed as ``flatcake.kernels``): the FC-CIO page scatter."""
