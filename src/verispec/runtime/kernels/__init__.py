"""verispec's C++ kernels, each beside its Python binding; `ext.py` builds them (`make kernels`), and where one does
not build the torch fallback runs (`invariant.py`: batch- and width-invariant by construction too)."""
