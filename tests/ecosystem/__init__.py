"""Models from the JAX ecosystem, unmodified: tied embeddings, weights through array ops,
sharding annotations; the Tunix matrix runs under `pytest -m ecosystem`."""
