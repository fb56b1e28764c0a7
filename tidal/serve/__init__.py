"""``tidal serve``: the embedded engine behind SGLang's HTTP protocol and OpenAI's (docs/engines.md)."""
