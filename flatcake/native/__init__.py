"""FlatCake's C loops: the loader and registry of the compiled extension's loops (``loops``);
``python -m flatcake.native`` prints each loop's state (``__main__``)."""
