// Camera choices on the page: which camera, what resolution, mirror, layout, full screen, snapshot.
// The choices are remembered (localStorage). Changing the camera or the resolution of a live stream
// changes what is sent in place: the resolution through applyConstraints, the camera by swapping the
// sent track (RTCRtpSender.replaceTrack), so there is no new offer and the stream keeps its id.

const STORAGE_KEY = "diffcast.camera";
// What the picker offers; the camera delivers the nearest it can (Chromium also scales down).
export const RESOLUTIONS = ["320x240", "640x480", "1280x720", "1920x1080"];
const DEFAULTS = { deviceId: "", resolution: "640x480", mirror: false, layout: "auto" };

const $ = (id) => document.getElementById(id);

function loadChoices() {
  try {
    const saved = JSON.parse(window.localStorage.getItem(STORAGE_KEY) || "{}");
    const choices = { ...DEFAULTS, ...saved };
    if (!RESOLUTIONS.includes(choices.resolution)) choices.resolution = DEFAULTS.resolution;
    return choices;
  } catch {
    return { ...DEFAULTS }; // storage blocked (private mode) or a value from an older page
  }
}

function size(resolution) {
  const [width, height] = resolution.split("x").map(Number);
  return { width: { ideal: width }, height: { ideal: height } };
}

export function setupCamera({ onError = () => {} } = {}) {
  const choices = loadChoices();
  let stream = null; // the page's camera stream while live (main.js stops it)
  let pc = null; // the WebRTC peer while live over WebRTC; null over the WebSocket fallback

  const save = () => {
    try {
      window.localStorage.setItem(STORAGE_KEY, JSON.stringify(choices));
    } catch {
      // Not remembered, still applied.
    }
  };

  const videoConstraints = () => ({
    ...size(choices.resolution),
    // A phone opens its front camera unless another one was chosen.
    ...(choices.deviceId ? { deviceId: { exact: choices.deviceId } } : { facingMode: "user" }),
  });

  const track = () => (stream ? stream.getVideoTracks()[0] || null : null);
  const sender = () => (pc ? pc.getSenders().find((s) => s.track && s.track.kind === "video") || null : null);

  async function refreshDevices() {
    const select = $("camera-select");
    const devices = (await navigator.mediaDevices.enumerateDevices()).filter((d) => d.kind === "videoinput");
    select.replaceChildren(new Option("default camera", ""));
    devices.forEach((device, index) => {
      if (device.deviceId) select.append(new Option(device.label || `camera ${index + 1}`, device.deviceId));
    });
    const known = devices.some((d) => d.deviceId === choices.deviceId);
    select.value = known ? choices.deviceId : "";
  }

  // The camera stream for a new stream: the chosen camera, else the default one (a remembered
  // camera that has gone, e.g. unplugged, is forgotten). ``extra`` adds other constraints (audio).
  async function open(extra = {}) {
    let opened;
    try {
      opened = await navigator.mediaDevices.getUserMedia({ video: videoConstraints(), ...extra });
    } catch (error) {
      if (!choices.deviceId || !["OverconstrainedError", "NotFoundError"].includes(error.name)) throw error;
      choices.deviceId = "";
      save();
      opened = await navigator.mediaDevices.getUserMedia({ video: videoConstraints(), ...extra });
    }
    refreshDevices().catch(() => {}); // labels are readable once the camera is granted
    return opened;
  }

  function attach(cameraStream, connection) {
    stream = cameraStream;
    pc = connection.pc || null;
    $("snapshot").disabled = false;
  }

  function detach() {
    stream = null;
    pc = null;
    $("snapshot").disabled = true;
  }

  async function switchCamera() {
    const old = track();
    if (!old) return; // not live: the choice is used at the next Start
    old.stop(); // first: many phones cannot open a second camera while one is open
    let fresh;
    try {
      [fresh] = (await navigator.mediaDevices.getUserMedia({ video: videoConstraints() })).getVideoTracks();
    } catch (error) {
      onError(`Could not open that camera (${error.message}); back to the default one.`);
      choices.deviceId = "";
      save();
      [fresh] = (await navigator.mediaDevices.getUserMedia({ video: videoConstraints() })).getVideoTracks();
    }
    stream.removeTrack(old);
    stream.addTrack(fresh);
    if (sender()) await sender().replaceTrack(fresh);
    // The input video (which the WebSocket fallback also reads) shows the new track.
    $("input").srcObject = null;
    $("input").srcObject = stream;
    await refreshDevices();
  }

  function applyLayout() {
    $("stage").dataset.layout = choices.layout;
    $("stage").classList.toggle("mirrored", choices.mirror);
  }

  function outputSource() {
    return $("output").hidden ? $("output-canvas") : $("output");
  }

  // The output as shown (mirrored when the page mirrors), at the stream's own size.
  function snapshotCanvas() {
    const source = outputSource();
    const width = source.videoWidth ?? source.width;
    const height = source.videoHeight ?? source.height;
    if (!width || !height) throw new Error("there is no output to take a snapshot of yet");
    const canvas = document.createElement("canvas");
    canvas.width = width;
    canvas.height = height;
    const context = canvas.getContext("2d");
    if (choices.mirror) {
      context.translate(width, 0);
      context.scale(-1, 1);
    }
    context.drawImage(source, 0, 0, width, height);
    return canvas;
  }

  async function downloadSnapshot() {
    const canvas = snapshotCanvas();
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = `diffcast-${new Date().toISOString().replace(/[:.]/g, "-")}.png`;
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
  }

  function toggleFullscreen() {
    if (document.fullscreenElement) return document.exitFullscreen();
    return $("output-pane").requestFullscreen();
  }

  // Wire the controls.
  for (const resolution of RESOLUTIONS) $("resolution-select").append(new Option(resolution, resolution));
  $("resolution-select").value = choices.resolution;
  $("mirror").checked = choices.mirror;
  $("layout-select").value = choices.layout;
  applyLayout();
  refreshDevices().catch(() => {});
  navigator.mediaDevices.addEventListener("devicechange", () => refreshDevices().catch(() => {}));
  $("camera-select").addEventListener("change", () => {
    choices.deviceId = $("camera-select").value;
    save();
    switchCamera().catch((error) => onError(`Could not switch the camera: ${error.message}`));
  });
  $("resolution-select").addEventListener("change", () => {
    choices.resolution = $("resolution-select").value;
    save();
    track()?.applyConstraints(size(choices.resolution))
      .catch((error) => onError(`The camera cannot give ${choices.resolution}: ${error.message}`));
  });
  $("mirror").addEventListener("change", () => {
    choices.mirror = $("mirror").checked;
    save();
    applyLayout();
  });
  $("layout-select").addEventListener("change", () => {
    choices.layout = $("layout-select").value;
    save();
    applyLayout();
  });
  $("fullscreen").addEventListener("click", () => toggleFullscreen()?.catch?.((e) => onError(e.message)));
  $("output").addEventListener("dblclick", () => toggleFullscreen()?.catch?.((e) => onError(e.message)));
  $("snapshot").addEventListener("click", () => downloadSnapshot().catch((error) => onError(error.message)));

  // What main.js uses, and what the browser tests read.
  return { open, attach, detach, track, sender, choices, snapshotCanvas };
}
