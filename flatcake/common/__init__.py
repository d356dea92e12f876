"""What every part of FlatCake shares: page geometry and byte views of KV buffers (``layout``),
the 4 KiB alignment of SSD I/O (``align``), and the error-once logger (``errorlog``)."""
