// A pane takes its picture's aspect: a stream keeps its camera's (4:3, 16:9; docs/default-model.md,
// "Camera aspect"), so neither picture is letterboxed into a square. The pane's CSS reads --aspect;
// object-fit: contain keeps the picture undistorted until it is known.

export function fitPane(element, width, height) {
  if (width && height) element.closest(".pane").style.setProperty("--aspect", `${width} / ${height}`);
}

export function followAspect(video) {
  const fit = () => fitPane(video, video.videoWidth, video.videoHeight);
  video.addEventListener("loadedmetadata", fit);
  video.addEventListener("resize", fit);
}
