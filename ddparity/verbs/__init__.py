"""The three verbs, one module each: :mod:`~ddparity.verbs.check`,
:mod:`~ddparity.verbs.profile` and :mod:`~ddparity.verbs.health`, with what they share in
:mod:`~ddparity.verbs.plan`. (A package of their own: a module ``ddparity/check.py`` would
be shadowed by the function ``ddparity.check``.)"""
