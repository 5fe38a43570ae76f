"""The stable core's Python twins: what the version-locked library registers in C++ and the
stable core, through LibTorch's C ABI, cannot (autograd, autocast, fake kernels, the fast
eager entry, the grouped ops). Registered by the loader when the core is the library that
loaded, never imported otherwise; an op added in C++ gets its twin here (csrc/README.md).
"""
