"""Files: atomic writes and every on-disk format (prep output, checkpoints, record, timeline,
the record's CSV and TensorBoard copies), and the run's recorder that writes the last two.

May import only ``theanompi.errors``, ``theanompi.registry`` and ``theanompi.comm``; prep and
training meet here and nowhere else.
"""
