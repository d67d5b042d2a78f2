"""What the gateway, the site engine and the predictor share, and nothing else: the gRPC contract
(site.proto, its committed stubs and their generator), loading a served model's tokenizer and its
fingerprint, reading PEM files, and reading settings from environment variables.

It imports neither torch nor any of the three packages that use it, so the gateway (and its
container image) depends on it alone, never on site_engine.
"""
