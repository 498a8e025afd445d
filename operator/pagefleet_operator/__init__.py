"""The PageFleet operator: reconciles InferenceService resources into serving pods.

Layout (one concept per file): `spec` reads and validates a resource, `get_*` builders
in `pod`, `deployment`, `service`, `ingress` and `pdb` turn it into objects, `plan`
compares desired with observed, `apply` executes a plan through `kube`, `status`
summarises what it sees, `autoscale` decides replica counts from `metrics`, and
`handlers` is the only module that registers anything with kopf.
"""

GROUP = "pagefleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
# kopf's finalizer on every InferenceService (its timers and daemons require one).
FINALIZER = f"{GROUP}/finalizer"
