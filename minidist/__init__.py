"""minidist: distributed training of language models, built by hand to be read.

One module per idea; the map, folder by folder, is lessons/reference/package.md. Nothing is imported here on purpose:
`import minidist.chess.games` should not pull in torch.distributed or transformers.
"""
