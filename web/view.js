// Bare WHEP viewer (e.g. an OBS Browser Source): plays /whep/<stream-id>, retries until it exists.
const streamId = decodeURIComponent(window.location.pathname.split("/").filter(Boolean).pop());
const video = document.getElementById("video");
const RETRY_MS = 2000;
// A server started with --token wants it on WHEP too: an OBS Browser Source passes it as ?token=.
const token = new URLSearchParams(window.location.search).get("token");
const auth = token ? { Authorization: `Bearer ${token}` } : {};
const state = { status: "connecting", frames: 0 };
window.diffcastViewer = state;

function countFrames() {
  state.frames += 1;
  video.requestVideoFrameCallback(countFrames);
}
video.requestVideoFrameCallback(countFrames);

// Sound plays where the browser allows it without a click (OBS Browser Sources do); elsewhere
// the video stays muted until a click on it. ?muted=1 keeps it muted.
function unmute() {
  if (new URLSearchParams(window.location.search).get("muted") === "1") return;
  video.muted = false;
  video.play().catch(() => {
    video.muted = true;
    video.addEventListener("click", () => { video.muted = false; }, { once: true });
  });
}

async function play() {
  const config = await (await fetch("/api/config")).json();
  const pc = new RTCPeerConnection({ iceServers: config.iceServers });
  pc.addTransceiver("video", { direction: "recvonly" });
  pc.addTransceiver("audio", { direction: "recvonly" }); // the stream's sound, when it has any
  const output = new MediaStream();
  pc.ontrack = (event) => {
    output.addTrack(event.track);
    if (video.srcObject !== output) video.srcObject = output;
    if (event.track.kind === "audio") {
      state.audio = true;
      unmute();
    }
  };
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") return resolve();
    pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && resolve());
    setTimeout(resolve, 3000);
  });
  const response = await fetch(`/whep/${encodeURIComponent(streamId)}`, {
    method: "POST",
    headers: { "Content-Type": "application/sdp", ...auth },
    body: pc.localDescription.sdp,
  });
  if (response.status !== 201) {
    pc.close();
    throw new Error(`WHEP ${response.status}: ${await response.text()}`);
  }
  const location = response.headers.get("Location");
  await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
  state.status = "playing";
  window.addEventListener("pagehide", () => fetch(location, { method: "DELETE", keepalive: true, headers: auth }));
  await new Promise((resolve) => {
    pc.addEventListener("connectionstatechange", () => {
      if (["failed", "closed", "disconnected"].includes(pc.connectionState)) resolve();
    });
  });
  pc.close();
  fetch(location, { method: "DELETE", headers: auth }).catch(() => {});
}

async function loop() {
  for (;;) {
    try {
      await play();
    } catch (error) {
      state.status = `waiting: ${error.message}`;
    }
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}
loop();
