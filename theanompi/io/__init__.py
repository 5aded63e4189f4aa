"""Files: atomic writes and every on-disk format (prep output, checkpoints, record, timeline).

May import only ``theanompi.errors``; prep and training meet here and nowhere else.
"""
