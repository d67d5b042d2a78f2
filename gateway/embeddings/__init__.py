"""The Embeddings API (POST /v1/embeddings): requests for a model the federation file marks as an
embedding model (`"task": "embed"`), prepared (validated, tokenized), admitted and recorded by the
request path's own owners, routed among the sites serving that model and embedded there."""
