"""drafters: the drafter interface and its kinds.

``base`` (the :class:`~dspark_jax.drafters.base.Drafter` / ``BlockDrafter`` protocols, the shared
output types, ``check_compatible``, ``prepare_drafter``) < ``decode_head`` (a draft vocabulary's
decode-time LM-head rows) and ``markov`` (Markov heads, block sampler) < ``dspark``
(DSpark / DFlash) and ``eagle`` (Eagle3 baseline) < ``build`` (``build_drafter``) <
``checkpoint`` (export / load).
"""
