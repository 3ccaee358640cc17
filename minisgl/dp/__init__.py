"""Data parallelism: several replicas of the model behind one server (or one offline LLM)."""
