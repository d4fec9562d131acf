"""Running a plan: the per-rank module and its collectives (:mod:`.module`), checkpoints
(:mod:`.checkpoint`), local multi-process launches (:mod:`.launch`), every rank simulated in one
process (:mod:`.simulate`), and the live-memory tracker the benches measure with (:mod:`.memtrack`)."""
