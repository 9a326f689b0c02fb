# A small static image of the operator, running as a non-root user.
#   docker build -t aether-operator:dev .
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends protobuf-compiler musl-tools \
    && rm -rf /var/lib/apt/lists/* \
    && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
COPY . .
RUN cargo build --release --locked --target x86_64-unknown-linux-musl -p aether-operator \
    && cp target/x86_64-unknown-linux-musl/release/aether-operator /aether-operator

FROM scratch
COPY --from=build /aether-operator /aether-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/aether-operator"]
CMD ["run"]
