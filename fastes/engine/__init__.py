"""The engine: the noise contract and the backends that honour it, the floor right above the base modules
(errors, version, distributed, checkpoint).

`noise` defines the contract (Philox keys and streams: which noise a member, a tensor and an element get),
`ops` holds the torch reference of perturb / update and dispatches to a backend, `cpu_library` builds
and calls the C library of `csrc/` (the CPU backend), `cpu_linear` chooses between its products and
torch's for a model's CPU linear layers, `kernels/` holds the Triton kernels (GPU backend)
and `lowrank` the low-rank factors on the same streams. `cpu_share` divides the CPU's cores between
fastes processes, and `cpu_memory` keeps the memory a CPU generation frees for its next tensors. Nothing
here knows of models, tasks or runs; import the submodules directly.
"""
