"""The pipeline's stages, one module each (`sft`, `distill`, `mtp`, `rl`), and `pipeline`, which
runs them in order in a workdir (records, resume, lock). Stages import the library (`bebop.*`,
`bebop.rl.*`, `bebop.checkpoints.*`); nothing in the library imports a stage."""
