"""Generic checkers: symmetry groups, equivariance, the manifold contract and its
hypothesis strategies, sympy certificates and Lipschitz bounds.

Import the submodule you need (``from geomuon.theory.contracts import check_manifold_contract``);
this package imports nothing on its own, so ``import theory`` stays cheap. Symmetry checks:
``from geomuon.theory.equivariance import assert_equivariant`` with a group of
:mod:`geomuon.theory.groups`; exact certificates: :mod:`geomuon.theory.symbolic`.
"""
