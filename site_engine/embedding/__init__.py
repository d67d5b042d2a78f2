"""A site that serves an embedding model: no KV cache, no decoding; each input is one forward
pass of the encoder, pooled into one vector. `layout` reads what the model directory says the
model is, `runner` computes embeddings, `batcher` batches the inputs of concurrent requests into
forward passes on a thread of its own."""
