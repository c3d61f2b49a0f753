"""User tools behind the CLI: benchmarks, the Ollama comparison, reports, shape twins (synth)."""
