"""The topic label of the relay's metrics, bounded: rows cannot explode it.

Rows name any topic their writer chooses (a topic per tenant or per aggregate is a common
outbox pattern; a writer's bug can mint one per row), and each label value is a Prometheus
series for the life of the process.  :class:`TopicLabels` gives the first ``max_topics``
topics seen their own label value and counts every later one under :data:`OTHER_TOPICS`.
A topic keeps the label it was first given: a series never changes its meaning, and its
counter stays monotonic.
"""

from __future__ import annotations

from relay.options import DEFAULT_METRICS_MAX_TOPICS

#: The label value shared by the topics past the bound (``--metrics-max-topics``).
OTHER_TOPICS = "_other"


class TopicLabels:
    """The label value each topic is counted under.

    Only topics with a label of their own are remembered: a writer minting a topic per row
    grows neither the series nor the relay's memory.  Not thread-safe: the pump's thread
    (marks applied, stalls tracked) is its only caller.
    """

    def __init__(self, max_topics: int = DEFAULT_METRICS_MAX_TOPICS) -> None:
        self.max_topics = max_topics
        self._labels: dict[str, str] = {}
        #: The caller said that the bound was reached (a log line, once: the first topic
        #: folded into :data:`OTHER_TOPICS` is the one it was labelling).
        self.folding_said = False

    def label(self, topic: str) -> str:
        """``topic`` itself while fewer than ``max_topics`` topics have a label (or it has
        one), else :data:`OTHER_TOPICS`.  One dict lookup for a topic seen before."""
        label = self._labels.get(topic)
        if label is not None:
            return label
        if len(self._labels) < self.max_topics:
            self._labels[topic] = topic
            return topic
        return OTHER_TOPICS

    @property
    def labelled(self) -> int:
        """Topics with a label value of their own."""
        return len(self._labels)
