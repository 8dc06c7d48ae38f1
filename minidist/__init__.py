"""minidist: distributed training of language models, built by hand to be read.

One module per idea (see README.md for the map). Nothing is imported here on purpose:
`import minidist.chess.games` should not pull in torch.distributed or transformers.
"""
