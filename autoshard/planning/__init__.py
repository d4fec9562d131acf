"""Planning around the solver: the :class:`~autoshard.planning.plan.Plan` a solve is priced into
(:mod:`.plan`), the logical meshes tried for one cluster (:mod:`.meshes`), the hand-written
baselines (:mod:`.baselines`), and the per-dim role rules both of those plan with (:mod:`.roles`)."""
