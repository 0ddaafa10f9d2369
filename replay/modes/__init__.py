"""Beyond the eager forward: the call compiled or from a CUDA graph (``compile_cudagraph``), its
backward (``backward``), and what its fastest mode would save a step (``opportunity``).
"""
