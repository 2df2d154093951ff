"""The engine under `q8rules serve`'s HTTP layer, and what `q8rules run` and `chat` share with it
(as llama.cpp's tools share common/): the sampler chain on the device, one row or many, and
the text of what it generates.

  sampling.py   the settings: one request's (`SamplingParams`), a batch's per row
                (`RowSettings`)
  chain.py      the chain, traced (`sample_rows`): bias, penalties, top-k, top-p, min-p,
                temperature, a draw; the vocabulary never sorted
  bitmask.py    a packed bitmask of allowed tokens (a grammar's) applied to logits
  reference.py  the chain in float64 numpy, the tests' yardstick
  detokenize.py incremental text from ids (a character's bytes and a possible stop string
                held back), cut at stop strings
  runner.py     the batched KV cache and its device programs (a prompt chunk into a slot,
                decode steps for every slot)
  scheduler.py  the queue, the slots, chunked prefill between decode steps, cancellation,
                faults kept to their request
  metrics.py    the engine's Prometheus metrics
"""
