"""fasttomo: neural-field (KPlanesTILTED) reconstruction for electron tomography."""

__version__ = "0.1.0"
