"""Built-in plugins, installed as ``cbtrace.plugins``: providers, inputs, backends, reporters."""
