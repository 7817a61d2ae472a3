"""The model side: tokenizer and chat templates, token chains, output parsers, the engine client."""
