"""The `python -m dspark_jax.*` commands: argument parsing and printing only; what they use lives in the package below."""
