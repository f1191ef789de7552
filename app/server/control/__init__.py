"""Control of a live stream: control messages checked at the edge, OSC, recording and the
owner's recordings API."""
