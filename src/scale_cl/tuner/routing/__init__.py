"""SCALE-Route's routing: the two paths' state on a model (`state`) and the routers behind one interface
(`router`): Eq. 5's cosine router (`cosine`, the paper's) and the routers that mix experts by one posterior
(`posterior`): the likelihood router (`likelihood`), the nested-stage router of a grown model (`nested`) and the
routers by each expert's confidence (`confidence`: the confidence router alone and the hybrid beside the prefix
posterior), and the calibrated router, their evidence weighed by a gate fitted to the model (`calibrated`).

A new router is a `Router` subclass in a file of its own that calls `register_router`, imported here (a mixing
router: a `MixtureRouter` that declares its evidence; the export computes it from that declaration); the route
settings (`route_settings`) are ``router`` and what each router declares.
"""

from scale_cl.tuner.routing import cosine, likelihood, nested  # noqa: F401, I001  (each registers its router)
from scale_cl.tuner.routing import confidence  # noqa: F401  (after them: the registry's order, --help's)
from scale_cl.tuner.routing import calibrated  # noqa: F401  (last: it weighs the others' evidence)
from scale_cl.tuner.routing.router import ROUTERS, HeadPaths, Router, register_router, route_settings, router_named

__all__ = ["ROUTERS", "HeadPaths", "Router", "register_router", "route_settings", "router_named"]
