"""dualkv.models: decoder layers and causal-LM models on the packed layout."""
