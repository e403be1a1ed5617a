"""The ES optimizer on top of the engine: `optimizer` (fastes.ES, a torch.optim.Optimizer, its members,
update and replay), `shaping` (rewards to update weights), `params` (which weights of a model evolve) and
`population` (every member of a generation evaluated in one batched forward). The public names are
re-exported by the fastes package itself (`fastes.ES`, `fastes.Member`, ...); import the submodules for
the rest.
"""
