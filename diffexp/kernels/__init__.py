"""Fast GPU kernels behind announced extension points (Triton), each tested against tests/reference.py."""
