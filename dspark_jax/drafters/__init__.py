"""drafters: the drafter interface and its kinds.

``base`` (the :class:`~dspark_jax.drafters.base.Drafter` / ``BlockDrafter`` protocols, the shared
output types, ``check_compatible``) < ``markov`` (Markov heads, block sampler) < ``dspark``
(DSpark / DFlash) and ``eagle`` (Eagle3 baseline) < ``build`` (``build_drafter``) <
``checkpoint`` (export / load).
"""
