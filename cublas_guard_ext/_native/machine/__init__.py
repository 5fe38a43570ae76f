"""Facts about this machine, best effort and never raising: torch/CUDA/cuBLAS versions and
GPUs (``facts``), which file each CUDA library was mapped from and the conflicts between
copies (``libraries``), and the known-bad library builds checked against them
(``known_builds``). Read by the doctor, the capsule and the cuBLAS error messages.
"""
