"""Files: atomic writes and every on-disk format (prep output, checkpoints, record, timeline,
the record's CSV and TensorBoard copies).

May import only ``theanompi.errors`` and ``theanompi.registry``; prep and training meet here
and nowhere else.
"""
