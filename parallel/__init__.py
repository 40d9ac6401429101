"""dualkv.parallel: sequence parallelism (Ulysses) for the packed layout and device meshes."""
