"""What reconstructs: the neural field (field/) and SIRT (sirt/)."""
